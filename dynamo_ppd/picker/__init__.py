"""The PPD endpoint picker: the routing state and planner both shells share (`dynamo_ppd.routing`)
behind Envoy's ext_proc protocol, so that Dynamo's own frontend carries every token (see
`picker.py`). Started by `python -m dynamo_ppd.picker` (`graphs/ppd.yaml`, the Helm chart's picker
pods); only the command line, the graphs and the benchmarks import it."""
