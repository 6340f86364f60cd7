"""POST /tokenize and /detokenize, the mainstream server's extensions.

They need the tokenizer alone, so they answer while the engine restarts or drains (only
the model name is checked). A text longer than the context is counted too:
`max_model_len` beside the count says whether it fits. Detokenizing keeps special tokens,
so /detokenize gives back exactly the text of the ids /tokenize gave.
"""

from __future__ import annotations

from typing import Any

from hybridserve.engine.frontend import check_in_vocabulary
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.context import ServerContext
from hybridserve.entrypoints.openai.errors import checked
from hybridserve.entrypoints.openai.harmony_history import harmony_messages
from hybridserve.entrypoints.openai.messages import content_chars, template_message
from hybridserve.entrypoints.openai.prepare import tokenized
from hybridserve.text.tokenizer import Tokenizer


async def tokenize_text(ctx: ServerContext, req: P.TokenizeRequest) -> dict[str, Any]:
    """A prompt's token ids, or a conversation's as chat renders it."""
    ctx.check_model(req.model)
    tok = _tokenizer(ctx, param="prompt" if req.messages is None else "messages")
    if (req.prompt is None) == (req.messages is None):
        raise P.ApiError("give either prompt or messages", param="prompt")
    if req.messages is not None:
        messages = [template_message(m, model=ctx.model_name) for m in req.messages]
        if ctx.harmony is not None:  # rendered as chat renders it
            messages = harmony_messages(messages, sources=req.messages)
        ids = await tokenized(lambda: tok.chat_prompt(messages)[1], num_chars=content_chars(messages))
    else:
        text = req.prompt
        ids = await tokenized(lambda: tok.encode(text, req.add_special_tokens, param="prompt"), num_chars=len(text))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tok.token_text(t) for t in ids]
    return body


async def detokenize_ids(ctx: ServerContext, req: P.DetokenizeRequest) -> dict[str, Any]:
    ctx.check_model(req.model)
    tok = _tokenizer(ctx, param="tokens")
    checked(lambda: check_in_vocabulary(req.tokens, ctx.engine.parts.vocab_size, "tokens"))
    text = await tokenized(lambda: tok.decode(req.tokens, skip_special_tokens=False), num_chars=len(req.tokens))
    return {"prompt": text}


def _tokenizer(ctx: ServerContext, param: str) -> Tokenizer:
    tok = ctx.engine.tokenizer
    if tok is None:
        raise P.ApiError("this model has no tokenizer", param=param)
    return tok
