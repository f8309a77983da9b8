//! Every configuration knob of symmem: its environment variable, default and meaning, in one
//! table that `symmem info` prints and the code reads from.

/// One configuration knob.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// The environment variable.
    pub env: &'static str,
    /// The default, as text.
    pub default: &'static str,
    /// What it controls.
    pub doc: &'static str,
}

/// Every knob, in the order `symmem info` lists them.
pub const KNOBS: &[Knob] = &[
    Knob {
        env: "RANK",
        default: "(required)",
        doc: "this process's rank in the job; set by `symmem run` and torchrun",
    },
    Knob { env: "WORLD_SIZE", default: "(required)", doc: "the number of ranks in the job" },
    Knob { env: "LOCAL_RANK", default: "RANK", doc: "this process's rank among the ranks on its host" },
    Knob { env: "LOCAL_WORLD_SIZE", default: "WORLD_SIZE", doc: "the number of ranks on this host" },
    Knob { env: "MASTER_ADDR", default: "(required)", doc: "host of the job's store" },
    Knob { env: "MASTER_PORT", default: "(required)", doc: "port of the job's store" },
    Knob {
        env: "TORCHELASTIC_USE_AGENT_STORE",
        default: "unset",
        doc: "\"True\": the launcher hosts the store and every rank connects as a client; otherwise rank 0 hosts it",
    },
    Knob {
        env: crate::store::SECRET_ENV,
        default: "`symmem run`: random (one host), the user's key (hosts)",
        doc: "the job's secret: the store's clients prove it (HMAC-SHA256), except this user's processes on the \
              store's host; also keys the ranks' links",
    },
    Knob {
        env: crate::store::JOB_SECRET_ENV,
        default: "SYMMEM_STORE_SECRET",
        doc: "the secret symmem's links between ranks require (both ends prove it), for jobs whose store cannot \
              carry one (torchrun)",
    },
    Knob {
        env: crate::store::TIMEOUT_ENV,
        default: "300",
        doc: "seconds before store operations and connection attempts time out",
    },
    Knob {
        env: crate::symm::HOST_ID_ENV,
        default: "hostname/boot id",
        doc: "this rank's host: ranks with the same one share memory, others reach each other through tcp",
    },
    Knob {
        env: crate::group::RENDEZVOUS_ENV,
        default: "auto",
        doc: "rendezvous exchanges: `store` (a multi-get per rank), `gather` (through rank 0), auto: gather above 32 ranks",
    },
    Knob {
        env: crate::ops::TIMEOUT_ENV,
        default: "60",
        doc: "seconds every operator and cross-host link waits before failing with who it waited for",
    },
    Knob {
        env: "SYMMEM_LOG",
        default: "warn",
        doc: "log filter (tracing-subscriber EnvFilter syntax), e.g. `symmem=debug`",
    },
];
