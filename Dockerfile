# syntax=docker/dockerfile:1
# agentd: multi-stage build → slim non-root runtime with tini and a HEALTHCHECK.
#
#   docker build -t agentd .
#   docker run --rm -p 7700:7700 -e AGENTD_TOKEN=change-me-to-a-long-token agentd        # demo
#   docker run --rm -p 7700:7700 -v $PWD/agentd.toml:/etc/agentd/config.toml:ro \
#     agentd serve --config /etc/agentd/config.toml

FROM rust:1.95-bookworm AS chef
RUN cargo install cargo-chef --locked --version 0.1.78
WORKDIR /app

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /app/recipe.json recipe.json
# Dependencies only: cached until Cargo.toml/Cargo.lock change.
RUN cargo chef cook --release --locked --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --bin agentd

FROM debian:bookworm-slim AS runtime
# ca-certificates: TLS to model providers and tools; tini: PID 1 that forwards SIGTERM and
# reaps child processes (stdio MCP servers).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/agentd --create-home agentd \
    && mkdir -p /etc/agentd
COPY --from=builder /app/target/release/agentd /usr/local/bin/agentd
COPY config/default.toml /etc/agentd/default.toml
# The embedded store (file:./data) lives here; mount a volume to keep runs across restarts.
WORKDIR /var/lib/agentd
USER 10001:10001
# Listen on all interfaces inside the container (overrides [server] listen, also for the demo).
ENV AGENTD__SERVER__LISTEN=0.0.0.0:7700 \
    AGENTD_URL=http://127.0.0.1:7700
EXPOSE 7700
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/usr/local/bin/agentd", "healthcheck"]
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/agentd"]
# With a mounted config: `serve --config /etc/agentd/config.toml` (see docker-compose.yml).
CMD ["serve"]
