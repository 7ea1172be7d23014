"""HTTP serving: the FastAPI app, OpenAI protocol models, generation and encoder backends, the Ray router."""
