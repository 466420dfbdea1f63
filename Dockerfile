# syntax=docker/dockerfile:1
# The muster operator image: a static (musl) binary at /muster on distroless, running
# as 65532:65532. Build from the repository root: docker build -t muster .

FROM rust:1-bookworm AS builder
RUN rustup target add x86_64-unknown-linux-musl \
 && apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Without the default `demo` feature: the image runs the operator only.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p muster --no-default-features --target x86_64-unknown-linux-musl \
 && cp target/x86_64-unknown-linux-musl/release/muster /muster

FROM gcr.io/distroless/static-debian12:nonroot
LABEL org.opencontainers.image.title="muster" \
      org.opencontainers.image.description="Gang scheduling with whole-gang DRA reservation for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /muster /muster
USER 65532:65532
ENTRYPOINT ["/muster"]
CMD ["run"]
