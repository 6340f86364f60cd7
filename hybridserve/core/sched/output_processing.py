"""Output processing: a step's sampled tokens appended to a request (with the block
hashes of the blocks they fill), and the stop check.

`append_one_token` is the fast path of `append_tokens` for the usual row (one token, no
drafts); the two agree on every input (tests/test_output_processing.py).
"""

from __future__ import annotations

from hybridserve.core.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Status the request finishes with after appending `token`, or None to go on."""
    sp = req.sampling_params
    num_outputs = len(req.output_token_ids)
    if num_outputs >= sp.min_tokens:
        if sp.stop_token_ids and token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token == req.eos_token_id and not sp.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
    if num_outputs >= sp.max_tokens or len(req.prompt_token_ids) + num_outputs >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def append_tokens(
    req: Request, sampled: list[int], max_model_len: int, block_size: int
) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens (accepted drafts + bonus) up to the first that stops the
    request, and hash the blocks they filled; returns the tokens appended and the status
    the request finishes with (or None)."""
    new_tokens: list[int] = []
    status = None
    for t in sampled:
        req.output_token_ids.append(t)
        new_tokens.append(t)
        status = check_stop(req, t, max_model_len)
        if status is not None:
            break
    num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
    if req._block_hasher is not None and num_tokens >= (len(req.block_hashes) + 1) * block_size:
        req.update_block_hashes()
    return new_tokens, status


def append_one_token(req: Request, token: int, max_model_len: int, block_size: int) -> RequestStatus | None:
    """`append_tokens` for a one-token row (returns only the status: the row is what is
    appended); the stop check runs only when something can stop the request (stop ids,
    EOS, or a length limit reached)."""
    outs = req.output_token_ids
    outs.append(token)
    sp = req.sampling_params
    num_outputs = len(outs)
    num_tokens = len(req.prompt_token_ids) + num_outputs
    if req._block_hasher is not None and num_tokens >= (len(req.block_hashes) + 1) * block_size:
        req.update_block_hashes()  # the token filled a block
    if (sp.stop_token_ids or (token == req.eos_token_id and not sp.ignore_eos)
            or num_outputs >= sp.max_tokens or num_tokens >= max_model_len):
        return check_stop(req, token, max_model_len)
    return None
