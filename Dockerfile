# The package on TensorFlow's 2.21 image, set up by the same script as a fresh clone (scripts/setup.sh):
# a .venv with requirements.txt's exact pins and the native parts built against that TensorFlow (the fused
# ops, and Horovod with Gloo and, Open MPI being installed, MPI). The test-only torch and torchvision
# (requirements-test.txt, about 5.5 GB) stay out of the image.
FROM tensorflow/tensorflow:2.21.0

RUN apt-get update \
    && apt-get install -y --no-install-recommends make cmake g++ python3-venv python3-dev git \
       openmpi-bin libopenmpi-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/mrcnn_tf2
COPY . .
RUN SETUP_TEST_DEPS=0 make setup

ENV PATH=/workspace/mrcnn_tf2/.venv/bin:$PATH
CMD ["make", "demo"]
