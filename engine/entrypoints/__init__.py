"""What users call: ``llm.LLM`` (offline), ``async_engine.AsyncLLMEngine`` (the loop on a
thread, outputs as async streams), and the OpenAI-compatible server (``server``, over
``openai_serving``, ``protocol`` and ``metrics``; ``python -m engine.serve``)."""
