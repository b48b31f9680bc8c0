"""HTTP server: OpenAI- and Ollama-compatible APIs over one engine, streaming, many clients at once."""
