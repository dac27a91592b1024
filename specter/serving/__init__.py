"""The OpenAI-compatible server: wire format (api.py), streamed text (text.py), the HTTP app (app.py)."""
