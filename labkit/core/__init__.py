"""The math of speculative decoding: sampling, acceptance rules, trees, typical acceptance, γ and tree-budget
policies, traces."""
