"""Multi-process execution: pipeline x tensor parallel workers on torch.distributed,
started as local processes (mp_executor) or Ray actors (ray_executor)."""
