"""Process-group helpers, TP/SP collectives as autograd Functions, RNG tracker, world discovery."""
