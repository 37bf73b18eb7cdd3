MODEL_PATH="/models/MiMo-7B-Base"
DRAFT_MODEL_PATH="/models/MiMo-7B-Base-mtp"

./xllm \
    --model $MODEL_PATH \
    --devices="cuda:0" \
    --port 13222 \
    --draft_model $DRAFT_MODEL_PATH \
    --draft_devices="cuda:0" \
    --num_speculative_tokens 1
