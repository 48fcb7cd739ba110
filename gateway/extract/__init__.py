"""`formwork extract`, the JSON-extraction app over the engine or a server.

Modules, each importing only those listed before it:
    inputs   the schema and the documents (UsageError for bad ones)
    records  one JSONL record per document: judged, counted, written, resumed
    prompt   the options and the prompt; a long document fitted to the context
    offline  every document through an in-process `LLM` in one call
    server   --server: the documents to an OpenAI-compatible server, concurrently
    cli      the command: add_arguments(parser), run(args) -> int, main(argv)
gateway/cli.py imports cli.py only when `formwork extract` runs; nothing here
imports gateway/cli.py.
"""
