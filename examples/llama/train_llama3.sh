#!/usr/bin/env bash
# ROCm Megatron-LM's train_llama3.sh name: train_llama.sh with MODEL=llama3 (knobs as there; KEY=VALUE arguments work).
MODEL=llama3 exec bash "$(dirname "$0")/train_llama.sh" "$@"
