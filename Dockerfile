# syntax=docker/dockerfile:1

# ---- build ----------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src
# sqlx query macros, if any, must not need a live database at build time.
ENV SQLX_OFFLINE=true CARGO_TERM_COLOR=never
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
    && install -D -m 0755 target/release/kfs-worker /out/kfs-worker

# ---- runtime --------------------------------------------------------------------------
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system kfs \
    && useradd --system --gid kfs --home-dir /app --no-create-home --shell /usr/sbin/nologin kfs
COPY --from=builder /out/kfs-worker /usr/local/bin/kfs-worker
# The migrations are embedded in the binary at compile time; kept here for reference.
COPY migrations /app/migrations
WORKDIR /app
USER kfs
EXPOSE 9464
ENTRYPOINT ["kfs-worker"]
CMD ["run"]
