"""Model definitions, config parsing and weight loading; pure functions of tokens and a forward batch."""
