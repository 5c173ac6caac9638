"""Building and checking PPD tables (`dynamo-ppd table build|evaluate`): `build` measures every
grid cell on the simulator, `live` on a running deployment through the benchmark's client,
`evaluate` asks whether the online correction earns its keep on scenarios the table was not built
on. The table itself (schema, lookup, the decision) is core: `dynamo_ppd.policy.table`."""
