"""The math of speculative decoding: sampling, acceptance rules, trees, typical acceptance, γ policies, traces."""
