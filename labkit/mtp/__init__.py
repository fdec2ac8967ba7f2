"""Multi-token prediction: small byte-level models trained here, with extra heads that draft for themselves."""
