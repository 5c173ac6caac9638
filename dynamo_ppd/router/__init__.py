"""The PPD router: a Dynamo component behind the OpenAI frontend that routes every turn of a
conversation through a prefill worker or straight to the decode worker holding its history.

Layout (as Dynamo's own routers: args, state, router): `args` (command line), `policy` (the pure
decision), `sessions` (etcd-backed session table), `residency` (KV events -> which blocks each
worker holds), `dispatch` (the P->D handoff and decode-local calls), `router` (the handler),
`metrics`, and `service` (runtime, registration, serving).
"""
