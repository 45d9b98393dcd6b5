"""The engine floor: vLLM's own server and every request the project sends it, for prep's regeneration and
capture, vLLM-fed training, on-policy rollouts and eval's engine evaluation. Above infra/, below data_prep/, train/
and eval/ (tests/test_architecture.py).

    config    the `vllm.*` keys (VLLMConfig), one meaning wherever they appear
    server    `vllm serve` started under a guard, checked and stopped, and the HTTP to it
    client    the one client: requests submitted, results taken as they complete, each with its own max_tokens and
              deadline, at most vllm.max_in_flight per server, the scratch files' bytes within one budget
    states    the hidden-states connector's files: received, checked and read
    plugin    what vLLM's own python imports of ours (the version check, the CPU hidden-states connector)
"""
