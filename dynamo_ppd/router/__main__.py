"""`python -m dynamo_ppd.router`: the PPD router component."""

from .service import main

main()
