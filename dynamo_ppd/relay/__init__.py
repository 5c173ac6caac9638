"""The relay router: a Dynamo component behind the OpenAI frontend (`python -m dynamo_ppd.relay`,
`dynamo-ppd router`, `graphs/ppd-relay.yaml`) that routes every turn of a conversation through a
prefill worker or straight to the decode worker holding its history, and relays every chunk.

A shell around `dynamo_ppd.routing` (the state and planner it shares with the endpoint picker):
`router` (`PpdRouter`, the handler), `dispatch` (the P->D handoff and decode-local calls over
Dynamo's request plane), `service` (runtime, registration, serving). `passthrough` is the bare
relay the benchmarks compare against (`graphs/relay.yaml`).
"""
