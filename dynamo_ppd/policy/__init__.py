"""The PPD policy, pure: the paper's score (`score`), the decision grid (`grid`), the table and its
lookup (`table`, the shipped tables in `tables/`), the per-request decision with online correction
(`decision`), the choice of workers (`placement`), the request rate (`qps`), and the policy inside
the simulation (`simulate`). The routing state of both shells (`dynamo_ppd.routing`) and the
simulator's PPD router use the same code."""
