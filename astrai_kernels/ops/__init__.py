"""One module per op family: contract, checks, forward and backward."""
