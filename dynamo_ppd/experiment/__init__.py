"""What every experiment shares (the live benchmark, the simulated studies, the paper's
reproduction, the engine checks, the advisor): `stats` (bootstrap intervals over whole
conversations), `progress` (the one progress bar), `plots` (a figure written as a PNG)."""
