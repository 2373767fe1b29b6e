# The handoff image: one image for the router (`handoff router`, the default command) and the
# transfer agent (`handoff agent`), on Node 24 LTS, with NIXL's C API and UCX taken from the
# nixl-cu12 wheel (docs/native.md). It runs as UID 10001, the user the Helm chart expects.
#
#   docker build -t registry.example.com/handoff:0.1.0 .
#   docker run --rm registry.example.com/handoff:0.1.0 --help
#
# No image is published: build it and push it to a registry your cluster pulls from
# (docs/deploy.md). The build reaches the npm registry, PyPI (the NIXL wheel, 69 MB) and
# Debian's mirrors.

# Both stages use the same base, so the addon is built against the Node that runs it.
ARG NODE_IMAGE=node:24-bookworm-slim

# ---------------------------------------------------------------------------------------------
FROM ${NODE_IMAGE} AS build

# cu12 or cu13: which NIXL wheel (`nixl-cuXX`) to fetch; the runtime stage must agree.
ARG NIXL_VARIANT=cu12

# python3 + pip: scripts/nixl-fetch.mjs downloads the wheel with `pip download` and unzips it
# with python's zipfile module. g++ + make: node-gyp builds native/. The slim image's Node
# ships its headers under /usr/local/include/node, so node-gyp downloads nothing.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip g++ make \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Dependencies first: this layer is reused while the lockfile is unchanged. `prepare` is run
# below in its three steps instead, so a source change does not fetch NIXL again. Skipping the
# dependencies' install scripts loses nothing: zeromq's (the only runtime one; esbuild's is a dev
# tool's) builds its addon only when none of the prebuilt ones it ships (build/linux/x64) loads.
COPY package.json package-lock.json ./
RUN npm ci --ignore-scripts --no-audit --no-fund

# NIXL. CI=true makes the fetch script fail the build when the wheel cannot be had, instead of
# producing an image whose agents cannot load NIXL. Then keep only what the addon loads: the
# NIXL libraries and plugins (.nixl_cuXX.mesonpy.libs), the auditwheel'd dependencies they
# reach through RPATH $ORIGIN/../nixl_cuXX.libs (UCX and its transport modules in ucx/,
# found by UCX next to libucs), and the dist-info (the version the addon reports, licenses).
# Left out: the Python module and nixl_ep (104 MB), which the addon never loads.
COPY scripts/nixl-fetch.mjs scripts/build-native.mjs scripts/
RUN CI=true NIXL_WHEEL_REQUIREMENT="nixl-${NIXL_VARIANT}>=1.3" npm run nixl:fetch \
 && wheel="$(ls -d .cache/nixl/nixl_${NIXL_VARIANT}-*/ | sort -V | tail -n 1)" \
 && mkdir -p /opt/nixl \
 && cp -a "${wheel}.nixl_${NIXL_VARIANT}.mesonpy.libs" "${wheel}nixl_${NIXL_VARIANT}.libs" \
          "${wheel}"nixl_${NIXL_VARIANT}-*.dist-info /opt/nixl/ \
 && test -f "/opt/nixl/.nixl_${NIXL_VARIANT}.mesonpy.libs/libnixl_capi.so" \
 && test -f "/opt/nixl/.nixl_${NIXL_VARIANT}.mesonpy.libs/plugins/libplugin_UCX.so"

# The addon (node-gyp, npm's bundled copy) and dist/ (tsc), then drop the dev dependencies.
COPY tsconfig.json tsconfig.build.json ./
COPY native/ native/
COPY common/ common/
COPY schemas/ schemas/
COPY router/ router/
COPY transfer-agent/ transfer-agent/
COPY sim/ sim/
COPY cli/ cli/
COPY bench/ bench/
COPY bin/ bin/
RUN npm run build:native \
 && npm run build \
 && npm prune --omit=dev --ignore-scripts --no-audit --no-fund \
 && test -f native/build/Release/handoff_native.node \
 && test -f dist/handoff.js

# ---------------------------------------------------------------------------------------------
FROM ${NODE_IMAGE} AS runtime

ARG NIXL_VARIANT=cu12

LABEL org.opencontainers.image.title="handoff" \
      org.opencontainers.image.description="Control plane for prefill/decode disaggregated LLM serving: the router and the transfer agent (NIXL)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.documentation="docs/deploy.md"

# libssl3: libnixl.so links NIXL's bundled gRPC/etcd client, which needs the system OpenSSL 3
# (the wheel leaves libssl/libcrypto out). The slim base keeps only what Node itself links
# (libstdc++6, libgcc-s1); the addon and NIXL need nothing else from the system. python3: the
# preStop drain (files/prestop-drain.py) of the chart's engine pods when they run the
# simulator from this image (engines.simulator).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl3 python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 handoff \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin handoff

WORKDIR /app

# Owned by root and not writable by the user: the chart also mounts the root file system
# read-only. package.json is needed at run time: it makes dist/ ESM ("type": "module") and
# marks the package root the addon's path is resolved from.
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules/ node_modules/
COPY --from=build /app/dist/ dist/
COPY --from=build /app/bin/ bin/
COPY --from=build /app/native/build/Release/handoff_native.node native/build/Release/
COPY --from=build /opt/nixl/ /opt/nixl/

# NIXL_LIB_DIR: the addon dlopens libnixl_capi.so there and points NIXL_PLUGIN_DIR at its
# plugins/ unless that is set. Everything else is found through the libraries' RPATHs.
ENV NODE_ENV=production \
    NIXL_LIB_DIR=/opt/nixl/.nixl_${NIXL_VARIANT}.mesonpy.libs

USER 10001:10001

# The router's port (values.yaml router.port); a transfer agent listens where --port says.
EXPOSE 8000

ENTRYPOINT ["node", "dist/handoff.js"]
CMD ["router"]
