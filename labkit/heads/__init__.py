"""Draft heads trained on the frozen target's features: the corpus, the features, Medusa."""
