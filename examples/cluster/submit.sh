#!/usr/bin/env bash
# Submit one training run to a Ray cluster as a Ray job and wait for it.
#
#   examples/cluster/submit.sh ADDRESS [training overrides...]
#   examples/cluster/submit.sh http://127.0.0.1:8265 +experiment=lstm_imdb data.root=/shared/data hydra.run.dir=/shared/runs/lstm
#
# ADDRESS is the head's dashboard (http://HEAD:8265). The checkout is uploaded as the job's
# working directory (without what .gitignore and .rayignore list); the job runs
# `python -m rayspec.train` with the overrides on the cluster, whose nodes must have rayspec's
# dependencies installed. Point hydra.run.dir (and data.root) at storage that outlives the job.
# The exit status is the job's: 0 only when it succeeded.
#
# Environment: ENTRY (the module the job runs, default rayspec.train; submit_study.sh sets rayspec.study),
# RAY (the ray command, default `ray`), RAY_AUTH_MODE (default: token when a token
# is at hand in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; a cluster started with
# RAY_AUTH_MODE=disabled ignores it), SUBMIT_OPTIONS (more `ray job submit` options, e.g.
# "--submission-id lstm-1 --entrypoint-num-cpus 1").
set -euo pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 ADDRESS [arguments of python -m ${ENTRY:-rayspec.train}...]   (ADDRESS: the head's dashboard, e.g. http://HEAD:8265)" >&2
    exit 2
fi
address=$1
shift
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] ||
    [ -f "$HOME/.ray/auth_token" ]; }; then
    export RAY_AUTH_MODE=token  # a client sends its token only in token mode
fi
# shellcheck disable=SC2086  # SUBMIT_OPTIONS is a list of words
exec "${RAY:-ray}" job submit --address "$address" --working-dir "$root" ${SUBMIT_OPTIONS:-} -- \
    python -m "${ENTRY:-rayspec.train}" "$@"
