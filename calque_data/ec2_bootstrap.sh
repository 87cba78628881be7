#!/bin/bash
# calque bootstrap: ${title}
# Written by `calque.py ${verb}` from calque_data/ec2_bootstrap.sh, filled in by ec2.py.
# No credentials here: this machine's access is its instance profile's (${profile}).
# Bootstrap output: /var/log/cloud-init-output.log; worker: journalctl -u ${unit}
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1   # pip asks no index about itself: a warm boot asks none
CALQUE=/opt/calque
BUCKET=${bucket}
KIT_KEY=${kit_key}
KIT_SHA256=${kit_sha256}
REGION=${region}
IMDS=${imds}
REPORT_PREFIX=${report_prefix}
ENV_PREFIX=${env_prefix}
ATTEMPTS=${attempts}
BACKOFF=${backoff}
STARTED=$(date -u +%Y%m%dT%H%M%SZ)
STAGE=setup
mkdir -p "$CALQUE/kit" /etc/calque ${state}

# try_to TRIES WHAT COMMAND...: up to TRIES times, the wait doubling from $BACKOFF s;
# the last stderr stays in $CALQUE/last-error for the failure report
try_to() {
  local tries=$1 what=$2 wait=$BACKOFF n=1
  shift 2
  STAGE=$what
  until "$@" 2>"$CALQUE/last-error"; do
    cat "$CALQUE/last-error" >&2
    if [ "$n" -ge "$tries" ]; then
      return 1
    fi
    echo "calque: $what failed (try $n of $tries): next try in $((wait))s" >&2
    sleep "$wait"
    n=$((n + 1)) wait=$((wait * 2))
  done
  cat "$CALQUE/last-error" >&2    # the warnings of the try that worked
}
retry() { try_to "$ATTEMPTS" "$@"; }   # a network step: a blip must not cost the instance
once() { try_to 1 "$@"; }
fail() { echo "calque: $1" | tee "$CALQUE/last-error" >&2; exit 1; }
json_of() {   # json_of KEY VALUE...: one JSON object of strings
  "${PY:-python3}" -c 'import json, sys
print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' "$@"
}

imds() {   # imds PATH: an instance metadata value (IMDSv2: a session token first)
  local token
  token=$(curl -fsS -X PUT "$IMDS/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300") &&
    curl -fsS -H "X-aws-ec2-metadata-token: $token" "$IMDS/latest/meta-data/$1"
}
has_cli() { command -v aws >/dev/null 2>&1; }
py_boto3() {   # py_boto3 CODE ARGS...: CODE with boto3 and sys.argv (an image without the AWS CLI)
  "$CALQUE/venv/bin/python" -c "import sys, boto3; $1" "${@:2}"
}
s3_get() {   # s3_get KEY FILE
  if has_cli; then
    aws s3 cp --only-show-errors --region "$REGION" "s3://$BUCKET/$1" "$2"
  else
    py_boto3 'boto3.client("s3", region_name=sys.argv[1]).download_file(*sys.argv[2:])' \
      "$REGION" "$BUCKET" "$1" "$2"
  fi
}
s3_put() {   # s3_put FILE KEY
  if has_cli; then
    aws s3 cp --only-show-errors --region "$REGION" "$1" "s3://$BUCKET/$2"
  else
    py_boto3 'boto3.client("s3", region_name=sys.argv[1]).upload_file(*sys.argv[2:])' \
      "$REGION" "$1" "$BUCKET" "$2"
  fi
}
# report STATE: how far this instance got, why it stopped, its fastbatch and torch (`pool status`)
report() {
  if [ -z "$REPORT_PREFIX" ] || [ -z "${INSTANCE_ID:-}" ]; then
    return 0
  fi
  local reason=""
  if [ "$1" = failed ]; then
    reason=$(tail -n 5 "$CALQUE/last-error" 2>/dev/null | cut -c1-300)
  fi
  json_of instance_id "$INSTANCE_ID" state "$1" stage "$STAGE" reason "$reason" started "$STARTED" \
    at "$(date -u +%Y-%m-%dT%H:%M:%SZ)" fastbatch "${FASTBATCH:-}" torch "${TORCH:-}" \
    torch_cuda "${TORCH_CUDA:-}" torch_gpu "${TORCH_GPU:-}" gpu "${GPU:-}" venv "${VENV:-}" \
    > "$CALQUE/report.json" &&
    s3_put "$CALQUE/report.json" "$REPORT_PREFIX$STARTED.$INSTANCE_ID.json"
}
# a pool instance leaves its group (SetInstanceHealth) so the ASG replaces it; else it powers off
leave_group() {
  if [ -n "${INSTANCE_ID:-}" ] && mark_unhealthy; then
    echo "calque: $INSTANCE_ID marked unhealthy: its auto scaling group replaces it" >&2
  else
    echo "calque: could not mark this instance unhealthy: powering off" >&2
    shutdown -h now
  fi
}
mark_unhealthy() {
  if has_cli; then
    aws autoscaling set-instance-health --region "$REGION" --instance-id "$INSTANCE_ID" \
      --health-status Unhealthy --no-should-respect-grace-period
  else
    py_boto3 'boto3.client("autoscaling", region_name=sys.argv[1]).set_instance_health(
      InstanceId=sys.argv[2], HealthStatus="Unhealthy", ShouldRespectGracePeriod=False)' \
      "$REGION" "$INSTANCE_ID"
  fi
}
power_off() {
  echo "calque: powering off" >&2
  shutdown -h now
}
on_exit() {
  local rc=$?
  if [ "$rc" -eq 0 ]; then
    return 0
  fi
  set +e
  echo "calque: bootstrap failed at $STAGE (exit $rc)" >&2
  report failed || echo "calque: could not write the failure report" >&2
  ${on_failure}
}
trap on_exit EXIT
${preamble}
if [ -n "$REPORT_PREFIX" ]; then
  retry "instance metadata" imds instance-id > "$CALQUE/instance-id"
  INSTANCE_ID=$(cat "$CALQUE/instance-id")
fi

# the worker runs as an unprivileged system user (NVIDIA device files are world-usable)
id -u calque >/dev/null 2>&1 || useradd --system --home-dir ${state} --shell /usr/sbin/nologin calque
chown calque: ${state}

# build tools: python3-venv for a venv on Ubuntu, gcc and the Python headers for fastbatch
if command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  retry "apt-get update" apt-get -o DPkg::Lock::Timeout=600 -o APT::Update::Error-Mode=any update -q
  retry "apt-get install" apt-get -o DPkg::Lock::Timeout=600 install -y -q python3-venv \
    python3-dev gcc zstd
elif command -v dnf >/dev/null 2>&1; then
  retry "dnf install" dnf install -y -q python3.11 python3.11-devel gcc zstd
fi
pick_python() {   # python3 when it is 3.11 or newer (python3-dev's headers are its own)
  local c
  for c in python3 python3.13 python3.12 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
STAGE=python
PY=$(pick_python) || fail "no python >= 3.11 on this image"
if ! has_cli; then   # an image without the AWS CLI fetches from S3 with the venv's boto3
  once "venv" "$PY" -m venv "$CALQUE/venv"
  retry "pip install boto3" "$CALQUE/venv/bin/pip" install -q --no-cache-dir ${boto3_pin}
fi

# the kit: an sdist of the operator's calque, checked against the digest pinned above
check_kit() { echo "$KIT_SHA256  $CALQUE/kit.tar.gz" | sha256sum -c -; }
retry "kit download" s3_get "$KIT_KEY" "$CALQUE/kit.tar.gz"
once "kit sha256 check" check_kit
once "kit unpack" tar -xzf "$CALQUE/kit.tar.gz" -C "$CALQUE/kit" --strip-components=1
${image_apt}

# the pool's environment: the venv with the kit's pinned requirements and the image's packages;
# no pip cache: torch's wheel is GBs and would be kept twice
build_env() {
  [ -d "$CALQUE/venv" ] || once "venv" "$PY" -m venv "$CALQUE/venv"
  retry "pip install -r requirements.txt" \
    "$CALQUE/venv/bin/pip" install -q -r "$CALQUE/kit/requirements.txt" --no-cache-dir
  ${image_pip}
}
# built by a pool's first instance and shared in the store under a key of all that shapes it
ENV_KEY=$({ cat "$CALQUE/kit/requirements.txt"; declare -f build_env; has_cli && echo aws-cli
  "$PY" -VV; echo "$PY"; cat /etc/os-release; uname -m; } 2>/dev/null | sha256sum | cut -c1-16)
# warm_env: the venv an earlier boot shared for ENV_KEY (its record names the archive and its
# digest); a missing record, a failed download or a damaged archive: install instead
warm_env() {
  local name sha
  [ -n "$ENV_PREFIX" ] || return 1
  if ! s3_get "$ENV_PREFIX$ENV_KEY.json" "$CALQUE/env.json" 2>"$CALQUE/env.err"; then   # one line, no traceback
    echo "calque: no venv shared for key $ENV_KEY yet ($(tail -n1 "$CALQUE/env.err")): installing it" >&2
    return 1
  fi
  read -r name sha < <("$PY" -c 'import json, sys
print(*map(json.load(open(sys.argv[1])).get, ("archive", "sha256")))' "$CALQUE/env.json") &&
    retry "venv download" s3_get "$ENV_PREFIX$name" "$CALQUE/env.tar" &&
    echo "$sha  $CALQUE/env.tar" | sha256sum -c --quiet - && mkdir "$CALQUE/venv.new" &&
    tar -xf "$CALQUE/env.tar" -C "$CALQUE/venv.new" && rm -rf "$CALQUE/venv" &&
    mv "$CALQUE/venv.new" "$CALQUE/venv" && rm "$CALQUE/env.tar" && VENV=unpacked && return 0
  echo "calque: the shared venv ${name:-record} is damaged or unreadable: installing instead" >&2
  rm -rf "$CALQUE/venv.new" "$CALQUE/env.tar"
  return 1
}
# share_env: the archive under a name of its digest (S3 shows an object only once whole), then
# the record naming it; two instances building at once each upload a whole archive and the last
# record wins; a failure is said and the boot goes on
share_env() {
  local z=gzip ext=gz sha
  if command -v zstd >/dev/null; then z="zstd -T0" ext=zst; fi
  STAGE="venv share"
  tar -I "$z" -cf "$CALQUE/env.tar" -C "$CALQUE/venv" . &&
    sha=$(sha256sum "$CALQUE/env.tar" | cut -c1-64) &&
    retry "venv upload" s3_put "$CALQUE/env.tar" "$ENV_PREFIX$ENV_KEY.${sha:0:16}.tar.$ext" &&
    json_of archive "$ENV_KEY.${sha:0:16}.tar.$ext" sha256 "$sha" \
      bytes "$(stat -c %s "$CALQUE/env.tar")" instance_id "${INSTANCE_ID:-}" \
      built "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$CALQUE/env.json" &&
    retry "venv record" s3_put "$CALQUE/env.json" "$ENV_PREFIX$ENV_KEY.json"
}
if ! warm_env; then
  build_env
  VENV=installed
  if [ -n "$ENV_PREFIX" ]; then
    if share_env; then
      VENV="installed, shared"
    else
      echo "calque: could not share the venv: later boots install it too" >&2
      VENV="installed, not shared"
    fi
    rm -f "$CALQUE/env.tar"
  fi
fi
# then calque from the kit's sdist: its build compiles fastbatch (a failed compile still installs)
once "pip install calque" "$CALQUE/venv/bin/pip" install -q --no-deps --no-build-isolation --no-cache-dir \
  "$CALQUE/kit.tar.gz"

# a fastbatch the install did not build is reported, and the worker told to use the numpy path
STAGE="fastbatch check"
FASTBATCH=$(cd / && "$CALQUE/venv/bin/python" -c 'import fastbatch; print(fastbatch.load())' \
  2>"$CALQUE/last-error") || FASTBATCH=""
cat "$CALQUE/last-error" >&2
if [ "$FASTBATCH" != c ]; then
  FASTBATCH="failed: $(tail -n 1 "$CALQUE/last-error" | cut -c1-300)"
fi
# which torch this instance got and whether it sees the GPU
STAGE="torch check"
if ! read -r TORCH TORCH_CUDA TORCH_GPU < <("$CALQUE/venv/bin/python" -c \
    'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'); then
  TORCH="import failed" TORCH_CUDA="" TORCH_GPU=""
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) || GPU=""
echo "calque: fastbatch $FASTBATCH; torch $TORCH (CUDA $TORCH_CUDA, GPU visible: $TORCH_GPU);" \
  "GPU ${GPU:-none}"

cat > /etc/calque/worker.env <<'CALQUE_ENV_EOF'
${env}
CALQUE_ENV_EOF
if [ "$FASTBATCH" != c ]; then
  echo "FASTBATCH_REFERENCE=1" >> /etc/calque/worker.env
fi

cat > "$CALQUE/worker.sh" <<'CALQUE_SH_EOF'
#!/bin/bash
set -a
. /etc/calque/worker.env
set +a
exec /opt/calque/venv/bin/warmd ${worker_args}
CALQUE_SH_EOF
chmod 755 "$CALQUE/worker.sh"

cat > /etc/systemd/system/${unit}.service <<'CALQUE_UNIT_EOF'
[Unit]
Description=calque ${description} (settings: /etc/calque/worker.env)
Wants=network-online.target
After=network-online.target
StartLimitIntervalSec=0

[Service]
Type=simple
User=calque
WorkingDirectory=${state}
ExecStart=/opt/calque/worker.sh
${service}
KillSignal=SIGTERM
TimeoutStopSec=${stop_timeout}
StandardOutput=journal
StandardError=journal
SyslogIdentifier=${unit}

[Install]
WantedBy=multi-user.target
CALQUE_UNIT_EOF
once "systemctl daemon-reload" systemctl daemon-reload
once "worker start" systemctl enable --now ${unit}.service
STAGE=ready
report ready || echo "calque: could not write the bootstrap report (the worker runs)" >&2
echo "calque: ${unit} started"
