"""``python -m engine.serve``: the OpenAI-compatible server (:mod:`engine.entrypoints.server`)."""

from engine.entrypoints.server import main

if __name__ == "__main__":
    main()
