"""The paper and the simulator's fidelity to measurements: `protocol` (`dynamo-ppd sim paper`, the
authors' benchmark point for point), `measured` (their H100 points, `data/`), `reproduce` (`just
reproduce`: the paper's tables and figures beside what its data says), `fidelity` (`sim
fidelity`: the simulator against those points), `interference` and `interference_paper` (the
interference micro-benchmark in a closed loop and in the paper's protocol)."""
