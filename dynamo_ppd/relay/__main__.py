"""`python -m dynamo_ppd.relay`: the PPD relay router component."""

from .service import main

main()
