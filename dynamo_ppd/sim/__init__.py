"""Virtual-clock simulation: the engine model of `dynamo_ppd.engine` driven by a discrete-event
loop instead of a wall clock (cluster runs, interference micro-benchmark)."""
