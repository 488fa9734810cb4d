"""One stage: freeze the upstream, train the stage's own module, prove the frozen part unchanged."""
