"""From a verdict to a decision: the pure policy, the decider that feeds it the store's history and stores its outcome, and the environments' modes."""
