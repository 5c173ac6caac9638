"""The simulator's studies (`dynamo-ppd sim compare`, docs/policies.md): every P/D policy (PPD,
Dynamo's, llm-d's, the fixed rules, replicas) on the same simulated GPUs, where PPD wins, ties and
loses. `policies` runs the grid and writes the report, `policy_points` is one policy at one point,
`saturation` the load sweeps up a ladder of rates, `sweep_report` their part of the report."""
