"""The tests' stand-in for a Triton + TensorRT-LLM deployment: a PyTriton server and its venv.

``pytriton_server.py`` runs in its own Python 3.12 venv (``setup_venv.py`` builds it) and
starts ``transformers_worker.py`` under the project's interpreter to run the model; neither
imports anything of this project, and nothing here is imported by the apps.
"""
