"""Checking and fitting the engine model (`dynamo-ppd engine calibrate|aic`): `fit` fits a
profile's cost constants to measured iteration times (e.g. from `scripts/gpu_calibrate.py`), `aic`
compares a profile with NVIDIA AIConfigurator's kernel tables and refits it. The model itself is
core: `dynamo_ppd.engine`."""
