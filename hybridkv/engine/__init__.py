"""Everything between a request and the model: tokenizing, chat templates, sampling, scheduling."""
