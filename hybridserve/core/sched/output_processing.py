"""Output processing: a step's sampled tokens appended to a request (with the block
hashes of the blocks they fill), and the stop check.

`settle_plain_decodes` is the fast path of the settling loop in
`Scheduler.update_from_output` for the usual rows (one token, no drafts, nothing that
can stop the request): it settles a run of them in one call, so a step of many decodes
pays one call, not one per token. The general path (that loop, with `append_tokens`)
settles every other row; the two agree (tests/core/test_output_processing.py,
tests/core/test_scheduler_short_path.py).
"""

from __future__ import annotations

from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.sched.output import LogprobInfo, PromptLogprobChunk, RequestOutput, ScheduledRequest

FINISHED = RequestStatus.FINISHED_STOPPED  # statuses >= this are finished


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


def receive_prompt_logprobs(req: Request, chunk: PromptLogprobChunk) -> None:
    """Keep the chunk's logprobs of the prompt tokens that have none yet, until an output
    carries them (take_prompt_logprobs).

    A request that asks for prompt logprobs computes its prompt from token 0 (no cache
    hit skips positions), so chunks arrive gapless from index 1; after a preemption it
    computes the prompt again, and the chunks that repeat indexes already received are
    dropped, so each prompt token is reported once.
    """
    skip = 1 + req.num_prompt_logprobs - chunk.first_index
    if skip < 0:  # a gap, which the rule above rules out: never report misplaced values
        return
    values = chunk.info.token_logprobs[skip:]
    if not values:
        return
    tops = chunk.info.top_logprobs
    tops = None if tops is None else tops[skip:]
    pending = req.pending_prompt_logprobs
    if pending is None:
        req.pending_prompt_logprobs = LogprobInfo(list(values), None if tops is None else list(tops))
    else:
        pending.token_logprobs.extend(values)
        if pending.top_logprobs is not None and tops is not None:
            pending.top_logprobs.extend(tops)
    req.num_prompt_logprobs += len(values)


def take_prompt_logprobs(req: Request) -> LogprobInfo | None:
    """The prompt logprobs received and not reported yet (None if there are none)."""
    pending, req.pending_prompt_logprobs = req.pending_prompt_logprobs, None
    return pending


def settle_plain_decodes(
    scheduled: list[ScheduledRequest],
    reqs: list[Request],
    epochs: list[int],
    sampled_rows: list[list[int]],
    start: int,
    max_model_len: int,
    block_size: int,
    logprobs_of: dict[str, LogprobInfo] | None,
    outputs: list[RequestOutput],
) -> int:
    """Settle rows start, start+1, ... of a processed step for as long as each is a plain
    decode, appending each one's RequestOutput to `outputs`; returns the index of the
    first row not settled (the general path takes it, untouched).

    A plain decode: one sampled token, no drafts, a sampling step scheduled since the
    request's last preemption, a request not finished and with no prompt logprobs to
    report, and nothing that could stop it after this token (no stop ids, not an EOS it
    honours, below max_tokens and max_model_len), so the stop check cannot fire and the
    row settles as the general path would settle it: in-flight tokens and the placeholder
    returned, the token appended, a block it fills hashed.
    """
    add_output = outputs.append
    i, stop = start, len(reqs)
    while i < stop:
        sampled = sampled_rows[i]
        if len(sampled) != 1:
            break
        sr, req = scheduled[i], reqs[i]
        if (not sr.samples or sr.num_draft_tokens or req.status >= FINISHED or epochs[i] != req.num_preemptions
                or req.pending_prompt_logprobs is not None):
            break
        token = sampled[0]
        sp = req.sampling_params
        outs = req.output_token_ids
        num_outputs = len(outs) + 1
        num_tokens = len(req.prompt_token_ids) + num_outputs
        if (sp.stop_token_ids or (token == req.eos_token_id and not sp.ignore_eos)
                or num_outputs >= sp.max_tokens or num_tokens >= max_model_len):
            break
        req.num_in_flight_tokens -= sr.num_scheduled_tokens
        req.num_output_placeholders -= 1
        outs.append(token)
        if req._block_hasher is not None and num_tokens >= (len(req.block_hashes) + 1) * block_size:
            req.update_block_hashes()  # the token filled a block
        cached = req.num_cached_tokens
        add_output(RequestOutput(sr.request_id, sampled, False, None, req.stop_reason,
                                 logprobs_of.get(sr.request_id) if logprobs_of else None, cached if cached > 0 else 0))
        i += 1
    return i
