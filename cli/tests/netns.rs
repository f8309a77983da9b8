//! Two hosts: two network namespaces joined by a veth pair, one launcher in each, and a tcp
//! transport between their ranks across the link. Skipped, saying why, where namespaces
//! cannot be created (not root, no iproute2).

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "rank programs and skip notices print")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::Hosts;
use symmem::Group;
use symmem::tensor::{DType, Tensor};
use symmem::transport::{Options, RemoteBuffer, new_transport_rank};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");

/// The rank program: a transport across the link, a write one way and a read the other.
#[test]
#[ignore = "a rank program; run by ranks_in_two_namespaces_move_tensors_over_tcp"]
fn netns_rank() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let g = Group::from_env().unwrap();
    let (me, peer) = (g.rank() as u64, 1 - g.rank() as u64);
    let t = Duration::from_secs(30);
    let link = new_transport_rank("tcp", None, g.store(), peer, me, t, &Options::new()).unwrap();
    let n = 1 << 20;
    let mine = Tensor::from_slice(&[n], &(0..n).map(|i| (i as u32).wrapping_mul(me as u32 + 3)).collect::<Vec<u32>>())
        .unwrap();
    let inbox = Tensor::zeros(&[n], DType::U32).unwrap();
    let (m_mine, m_inbox) = (link.register_memory_read_only(&mine).unwrap(), link.register_memory(&inbox).unwrap());
    let mut both = m_mine.to_remote_buffer().unwrap().serialize();
    both.push(b'\n');
    both.extend(m_inbox.to_remote_buffer().unwrap().serialize());
    let all = g.all_gather_bytes("descriptors", &both).unwrap();
    let theirs = String::from_utf8(all[peer as usize].clone()).unwrap();
    let (their_mine, their_inbox) = theirs.split_once('\n').unwrap();
    let (their_mine, their_inbox) = (
        RemoteBuffer::deserialize(their_mine.as_bytes()).unwrap(),
        RemoteBuffer::deserialize(their_inbox.as_bytes()).unwrap(),
    );
    let url = String::from_utf8(link.bind(None).unwrap()).unwrap();
    assert!(url.starts_with(&format!("tcp://10.213.0.{}:", me + 1)), "the URL names this host's address: {url}");
    assert!(!symmem::topo::this_host().starts_with(&format!("machine{peer}/")), "each namespace is its own host");
    if me == 0 {
        link.write(&m_mine.to_view(0, None).unwrap(), &their_inbox, None).unwrap();
    } else {
        let back = Tensor::zeros(&[n], DType::U32).unwrap();
        let mb = link.register_memory(&back).unwrap();
        link.read(&mb.to_mutable_view(0, None).unwrap(), &their_mine, None).unwrap();
        let want: Vec<u32> = (0..n).map(|i| (i as u32).wrapping_mul(3)).collect();
        assert_eq!(back.to_vec::<u32>().unwrap(), want, "read across hosts");
    }
    g.barrier(t).unwrap();
    if me == 1 {
        let want: Vec<u32> = (0..n).map(|i| (i as u32).wrapping_mul(3)).collect();
        assert_eq!(inbox.to_vec::<u32>().unwrap(), want, "write across hosts");
    }
    g.barrier(t).unwrap();
    link.close(Some(t)).unwrap();
    println!("rank {me} ok");
}

#[test]
fn ranks_in_two_namespaces_move_tensors_over_tcp() {
    let hosts = match Hosts::create(2) {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    let me = std::env::current_exe().unwrap();
    // The namespaces share this machine's file system, as hosts share a home directory: this
    // user's key is the job's secret.
    let config = tempfile::tempdir().unwrap();
    // Two machines as a user meets them: each its own hostname (a UTS namespace) and address,
    // and no SYMMEM_* variable set: the launcher finds the job's secret in this user's key, and
    // each rank publishes the address of its route to the store.
    let node = |i: usize| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.names[i], "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
            .arg(format!("machine{i}"))
            .args([BIN, "run", "-n", "1", "--nnodes", "2"])
            .args(["--node-rank", &i.to_string(), "--master-addr", "10.213.0.1", "--master-port", "29500"])
            .args(["--timeout", "60", "--"])
            .arg(&me)
            .args(["--exact", "netns_rank", "--include-ignored", "--nocapture"])
            .env("XDG_CONFIG_HOME", config.path());
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("SYMMEM_") {
                c.env_remove(k);
            }
        }
        c.output().unwrap()
    };
    let second = std::thread::scope(|s| {
        let b = s.spawn(|| node(1));
        let a = node(0);
        (a, b.join().unwrap())
    });
    for (i, out) in [second.0, second.1].iter().enumerate() {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "host {i}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            text.lines().any(|l| l.starts_with(&format!("[{i}] ")) && l.ends_with(&format!("rank {i} ok"))),
            "{text}"
        );
    }
}
