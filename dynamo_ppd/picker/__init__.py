"""The PPD endpoint picker: the relay router's routing state and planner behind Envoy's ext_proc
protocol, so that Dynamo's own frontend carries every token (see `picker.py`)."""
