# The package on TensorFlow's 2.21 image, set up by the same script as a fresh clone (scripts/setup.sh):
# a .venv with requirements.txt's exact pins and the native parts built against that TensorFlow.
FROM tensorflow/tensorflow:2.21.0

RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/mrcnn_tf2
COPY . .
RUN make setup

ENV PATH=/workspace/mrcnn_tf2/.venv/bin:$PATH
CMD ["make", "demo"]
