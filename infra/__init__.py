"""The floor every package stands on: what data_prep/, train/, eval/, launch/ and bench/ use, importing nothing
else of ours (tests/test_architecture.py).

    strict_json    strict JSON and atomic writes for every file and line the project writes
    files          weights files (safetensors) written with the mode the umask gives every other file
    dirlock        one writer per prep or run directory
    preemption     SIGTERM/SIGUSR1 as a clean, resumable stop (exit 75), and dying with the launcher
    processes      a free local port, dying with one's parent, a process's peak memory
    config_keys    config keys checked against their schema; ConfigError, the user error of a config
"""
