"""`dynamo-ppd advise`: which deployment to run for a workload and a GPU count, from the simulator
(`advise`: the candidates, their simulation, the Pareto front and the recommendation; the command
line is `dynamo_ppd.cli.advise`)."""
