"""`formwork extract` offline: every document through an in-process `LLM` in one
call, so that the engine batches them continuously (server.py is the --server
counterpart).
"""
from __future__ import annotations

from formwork.gateway.extract.inputs import Document
from formwork.gateway.extract.prompt import ExtractOptions, LocalMeter, fitted_prompt
from formwork.gateway.extract.records import judge, make_record, make_validator


def extract_offline(llm, docs: list[Document], opts: ExtractOptions, emit, *,
                    progress: bool = True) -> None:
    """Calls `emit(record)` for every document as soon as its record is known:
    unsent ones (errors, skipped) first, then each sent one as it finishes, so
    an interrupted run leaves its finished records behind for --resume. Every
    document that is sent goes to `llm.chat` in one call, so the engine
    batches them continuously."""
    validator, meter = make_validator(opts.schema, opts.model), LocalMeter(llm.tokenizer)
    convs, sent = [], []                    # sent[k]: (index in docs, truncated) of convs[k]
    for i, doc in enumerate(docs):
        prompt = (make_record(doc, error=doc.error) if doc.error
                  else fitted_prompt(doc, opts, meter, llm.engine.max_model_len))
        if isinstance(prompt, dict):
            emit(prompt)
        else:
            convs.append(prompt[0])
            sent.append((i, prompt[1]))

    def finished(k: int, out) -> None:
        i, truncated = sent[k]
        c = out.outputs[0]
        emit(judge(docs[i], c.text, c.finish_reason, validator, truncated=truncated,
                   usage=(len(out.prompt_token_ids), len(c.token_ids)), error=c.error))

    if convs:
        llm.chat(convs, opts.sampling_params(), use_tqdm=progress, on_finished=finished)
