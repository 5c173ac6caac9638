"""`python -m dynamo_ppd.picker`: the PPD endpoint picker (Envoy ext_proc)."""

from .service import main

main()
