#!/usr/bin/env bash
# ROCm Megatron-LM's train_llama2.sh name: train_llama.sh with MODEL=llama2 (knobs as there; KEY=VALUE arguments work).
MODEL_SIZE=${MODEL_SIZE:-7} MODEL=llama2 exec bash "$(dirname "$0")/train_llama.sh" "$@"
