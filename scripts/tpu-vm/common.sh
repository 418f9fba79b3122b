# shellcheck shell=bash
# Shared by the scripts beside it (sourced, never run): options, the config file, dry runs, and
# the gcloud commands they all build. Written for bash 3.2 too (macOS): no associative arrays.

set -euo pipefail

# shellcheck disable=SC2034  # the globals below are read by the scripts that source this file
SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN=0
CONFIG_FILE=""
EXTRA_ARGS=()
OPTION_WIDTH=0

die() {
  printf '%s: %s\n' "$(basename "$0")" "$*" >&2
  exit 1
}

# The comment block at the top of the calling script, after its shebang, is its help.
usage() {
  sed -n '2,/^$/{/^# shellcheck/d;s/^# \{0,1\}//;p;}' "$0"
  cat <<'EOF'
Options every script takes:
  --config FILE   the config file (default: $TPU_VM_CONFIG, else config.env beside the scripts;
                  start from config.env.example)
  --dry-run       print the gcloud commands, exactly, instead of running them
  -h, --help      this help
EOF
}

# Parses the options every script takes; a script's own options go to its `handle_option`
# function, which sets OPTION_WIDTH to the number of words it used (returns non-zero if the
# option is not its own). Words after `--` are kept in EXTRA_ARGS.
parse_args() {
  while (($#)); do
    case $1 in
      --config)
        (($# >= 2)) || die "--config needs a file"
        CONFIG_FILE=$2
        shift 2
        ;;
      --config=*)
        CONFIG_FILE=${1#*=}
        shift
        ;;
      --dry-run)
        DRY_RUN=1
        shift
        ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        # shellcheck disable=SC2034  # read by the scripts that source this file
        EXTRA_ARGS=("$@")
        return 0
        ;;
      *)
        if declare -F handle_option >/dev/null && handle_option "$@"; then
          shift "$OPTION_WIDTH"
        else
          die "unknown option $1 (see --help)"
        fi
        ;;
    esac
  done
}

# Every variable of the config file (config.env.example documents each).
CONFIG_VARS=(PROJECT ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION CREATE_WITH QUEUED_RESOURCE
  PROVISIONING CREATE_TIMEOUT CREATE_FLAGS PACKAGE_SOURCE PYTHON TORCH_INDEX_URL HF_TOKEN_FILE
  REMOTE_DIR MODEL MODEL_GCS CONVERT_SOURCE CONVERT_OUT CONVERT_GCS TENSOR_PARALLEL_SIZE SERVER
  PORT MASTER_PORT FIREWALL SERVE_ARGS SERVE_ENV HEALTH_TIMEOUT HEALTH_INTERVAL STOP_TIMEOUT SSH_FLAGS)

# Sources the config file and fills in the optional variables' defaults. The config file is
# the only source: variables of the same names in the environment (PORT, PYTHON, ZONE are
# common) are dropped first.
load_config() {
  local file=${CONFIG_FILE:-${TPU_VM_CONFIG:-$SCRIPTS_DIR/config.env}}
  [[ -f $file ]] || die "no config file $file: copy $SCRIPTS_DIR/config.env.example there and fill it in, or pass --config FILE"
  unset "${CONFIG_VARS[@]}"
  # shellcheck source=/dev/null
  source "$file"
  CONFIG_FILE=$file
  CREATE_WITH=${CREATE_WITH:-queued}
  QUEUED_RESOURCE=${QUEUED_RESOURCE:-${TPU_NAME:-}-qr}
  PROVISIONING=${PROVISIONING:-on-demand}
  CREATE_TIMEOUT=${CREATE_TIMEOUT:-3600}
  REMOTE_DIR=${REMOTE_DIR:-vllm-xla}
  PYTHON=${PYTHON:-python3.11}
  TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
  SERVER=${SERVER:-vllm-xla}
  PORT=${PORT:-8000}
  MASTER_PORT=${MASTER_PORT:-29500}
  FIREWALL=${FIREWALL:-hosts}
  HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1800}
  HEALTH_INTERVAL=${HEALTH_INTERVAL:-15}
  STOP_TIMEOUT=${STOP_TIMEOUT:-60}
  words_of "${SSH_FLAGS:-}" SSH_FLAG_WORDS
}

# Fails naming every required variable that is unset or empty in the config file.
require_vars() {
  local name missing=()
  for name in "$@"; do
    [[ -n ${!name:-} ]] || missing+=("$name")
  done
  ((${#missing[@]} == 0)) ||
    die "${missing[*]} not set in $CONFIG_FILE (see $SCRIPTS_DIR/config.env.example)"
}

require_number() {
  local name=$1
  [[ ${!name} =~ ^[0-9]+$ ]] || die "$name=${!name} in $CONFIG_FILE is not a whole number"
}

# Splits a config variable into words (no globbing) into the array named $2.
words_of() {
  read -r -a "$2" <<<"$1" || true
}

# One word, quoted for a POSIX shell only when it needs it (copy-pasteable output).
shell_quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

join_quoted() {
  local word out=""
  for word in "$@"; do
    out+="${out:+ }$(shell_quote "$word")"
  done
  printf '%s' "$out"
}

# Remote shell steps joined into one command line that stops at the first failing step.
join_steps() {
  local step out=""
  for step in "$@"; do
    out+="${out:+ && }$step"
  done
  printf '%s' "$out"
}

# Runs a command, or only prints it under --dry-run; runs are traced on stderr.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(join_quoted "$@")"
    return 0
  fi
  printf '+ %s\n' "$(join_quoted "$@")" >&2
  "$@"
}

location_flags() {
  printf '%s\n' "--project=$PROJECT" "--zone=$ZONE"
}

# gcloud compute tpus tpu-vm ssh on one worker (a number) or on `all`.
ssh_on() {
  local worker=$1 command=$2
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--project=$PROJECT" "--zone=$ZONE" \
    "--worker=$worker" ${SSH_FLAG_WORDS[@]+"${SSH_FLAG_WORDS[@]}"} "--command=$command"
}

# Copies a local file into the home directory of every worker.
scp_to_all() {
  run gcloud compute tpus tpu-vm scp "$1" "$TPU_NAME:$2" "--project=$PROJECT" "--zone=$ZONE" \
    --worker=all ${SSH_FLAG_WORDS[@]+"${SSH_FLAG_WORDS[@]}"}
}

# The internal IP of every worker, host 0 first, one a line (what `describe` lists).
describe_ips_command() {
  printf '%s\n' gcloud compute tpus tpu-vm describe "$TPU_NAME" "--project=$PROJECT" "--zone=$ZONE" \
    --flatten=networkEndpoints '--format=value(networkEndpoints.ipAddress)'
}

# Hosts of a slice by its accelerator type, for dry runs only (a real run counts what
# `describe` lists): v5e and v6e have up to 8 chips on one host and 4 a host beyond; v4 and v5p
# types count TensorCores, 8 a host.
hosts_of_accelerator() {
  local type=$1 size=${1##*-} per_host
  [[ $size =~ ^[0-9]+$ ]] || die "cannot tell the hosts of ACCELERATOR_TYPE=$type"
  case $type in
    v6e-* | v5e-* | v5litepod-*) per_host=4 ;;
    v5p-* | v4-*) per_host=8 ;;
    *) die "a dry run cannot tell the hosts of ACCELERATOR_TYPE=$type (a real run asks describe)" ;;
  esac
  if ((size <= 8)); then echo 1; else echo $((size / per_host)); fi
}

# Whether ACCELERATOR_TYPE is a slice of several hosts (more than 8 chips or TensorCores; see
# hosts_of_accelerator), whose hosts join through host 0's MASTER_PORT and the port after it.
several_hosts() {
  local size=${ACCELERATOR_TYPE##*-}
  [[ $size =~ ^[0-9]+$ ]] && ((size > 8))
}

# The firewall rules that keep host 0's MASTER_PORT (vLLM's store) and MASTER_PORT+1 (JAX's
# coordinator, which authenticates nobody) to the slice's own workers (FIREWALL=hosts): the
# workers carry the network tag, an allow rule lets tagged workers in, a deny rule below it
# keeps everyone else out (the default network lets every internal address in otherwise).
firewall_tag() { printf '%s-hosts' "$TPU_NAME"; }
firewall_rules() { printf '%s\n' "$(firewall_tag)" "$(firewall_tag)-deny"; }
firewall_wanted() {
  case $FIREWALL in
    hosts) several_hosts ;;
    none) return 1 ;;
    *) die "FIREWALL=$FIREWALL: use hosts or none" ;;
  esac
}

# The files a server leaves on each worker, relative to the worker's home directory.
remote_pid_file() { printf '%s/serve.pid' "$REMOTE_DIR"; }
remote_log_file() { printf '%s/serve.log' "$REMOTE_DIR"; }
remote_bin() { printf '%s/venv/bin/%s' "$REMOTE_DIR" "$1"; }
