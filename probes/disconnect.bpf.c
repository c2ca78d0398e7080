/* Client disconnects on watched server ports, from two tracepoints only (no kprobes):
 *   sock:inet_sock_set_state  -> peer_fin, local_fin, closed
 *   tcp:tcp_receive_reset     -> peer_rst
 * peer_rst comes from tcp_receive_reset alone, never from the move to CLOSE a reset causes. Two
 * closes are not reported, as they tell nothing the connection's previous record did not (one
 * record a connection instead of two):
 *  - after a local_fin: the socket reaches CLOSE from FIN_WAIT1, FIN_WAIT2 or CLOSING;
 *  - the one a received reset causes: tcp_reset() fires tcp_receive_reset, then moves the socket
 *    to CLOSE, in the same softirq on the same CPU, with no other socket's transition between.
 *    The reset handler leaves the socket's address and the time in a per-CPU slot; the next
 *    transition on a watched port on that CPU takes it (and clears it), and a CLOSE of that same
 *    socket within RESET_CLOSE_NS is the reset's own. A slot left behind (a reset that found the
 *    socket closed already, so no transition follows) is cleared by the next transition on that
 *    CPU; to match, that would have to be the close of a new socket at the same address within
 *    the same millisecond. Where the two are split (a reset read from a socket's backlog in
 *    process context, then preempted or moved), the close is reported as before: a record too
 *    many, never one missing.
 *
 * Only server-side sockets are reported: the local port (sport) must be in watched_ports, which
 * user space updates at run time. Loopback clients of a watched port have it as dport, not sport.
 * Build-time settings arrive as defines: RINGBUF_PAGES, WAKEUP_EVERY, CLIENT_SLOT_BITS and
 * FAMILY_FROM_SOCKET (see TCP_FAMILY).
 *
 * server_pids names the process serving each watched port at each of its local addresses (pods of
 * a node serve one port, each from its own network's address): the tgid of the task that closed
 * one of its connections, taken only on the transitions the server's own close() or shutdown() makes
 * (ESTABLISHED -> FIN_WAIT1, CLOSE_WAIT -> LAST_ACK), which run in that process's context. A
 * received FIN, a reset or the final ACK are handled in softirq, where the current task is
 * whichever one the interrupt found (on loopback, often the client): those never write it.
 *
 * The clients table holds every ESTABLISHED server socket of a watched port (its ports and the
 * client's address): added when a passive open completes (SYN_RECV -> ESTABLISHED), removed on its
 * first move out of ESTABLISHED, with when the server last read data from it
 * (tcp:tcp_rcv_space_adjust, which tcp_recvmsg fires after copying: a request read, not each
 * packet). User space adds the connections a port already had when it is watched (from
 * sock_diag), and lists the table with the engines' scrapes: the clients connected, and which of
 * them sent something since their last answer. It is two maps: client_slots, an array a socket
 * claims by its address (one compare-and-swap, no allocation, no lock), and the clients hash for
 * the rest (a slot already held, the connections user space adds, kernels without BPF atomics).
 * A hash insert and delete cost about as much as all the other work of a connection together.
 *
 * Records are submitted without waking the reader, except every WAKEUP_EVERY-th on a CPU: one
 * wake-up per record would cost the server (irq work in its softirq) and the reader (a Python
 * round trip per event). User space also consumes on its poll timeout, so a lone event on a quiet
 * host waits at most one poll interval; its timestamp is taken here and never delayed. A client's
 * leaving (its FIN or reset) wakes the reader at once unless another's did, on any CPU, within
 * DEPARTURE_WAKEUP_NS: the daemon acts on a departure (it lists the port's clients with the next
 * scrape, and samples the GPU), so it hears of a lone one within a millisecond, and pays at most
 * one such wake-up a DEPARTURE_WAKEUP_NS however many clients leave (user space polls that often
 * after a departure, for the ones in between).
 */
#include <uapi/linux/ptrace.h>
#include "disconnect.h"

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 4096
#endif
#ifndef WAKEUP_EVERY
#define WAKEUP_EVERY 1024
#endif
#ifndef DEPARTURE_WAKEUP_NS
#define DEPARTURE_WAKEUP_NS 100000000ULL
#endif
#ifndef MAX_CLIENTS
#define MAX_CLIENTS 65536
#endif
/* A reset's own close follows it within microseconds (the same softirq): a generous bound. */
#define RESET_CLOSE_NS 1000000ULL

/* Copied from include/net/tcp_states.h, which is kernel-internal (not uapi). */
#define TCP_ESTABLISHED_ 1
#define TCP_SYN_RECV_ 3
#define TCP_FIN_WAIT1_ 4
#define TCP_FIN_WAIT2_ 5
#define TCP_CLOSE_ 7
#define TCP_CLOSE_WAIT_ 8
#define TCP_LAST_ACK_ 9
#define TCP_LISTEN_ 10
#define TCP_CLOSING_ 11
#define AF_INET_ 2
#define AF_INET6_ 10
#define IPPROTO_TCP_ 6

/* The socket's address family on the tcp:* tracepoints (tcp_receive_reset, tcp_rcv_space_adjust).
 * Their records carry it on newer kernels; older ones (5.10's) lack the field, and user space then
 * defines FAMILY_FROM_SOCKET: the family is read from the socket itself, skc_family, which follows
 * struct sock_common's address, hash and port words (offset 16) on every kernel with these
 * tracepoints. sock:inet_sock_set_state has always carried it. */
#ifdef FAMILY_FROM_SOCKET
#define SKC_FAMILY_OFFSET 16
static __always_inline u16 socket_family(const void *skaddr)
{
    u16 family = 0;
    bpf_probe_read_kernel(&family, sizeof(family), (const char *)skaddr + SKC_FAMILY_OFFSET);
    return family;
}
#define TCP_FAMILY(args) socket_family((args)->skaddr)
#else
#define TCP_FAMILY(args) ((args)->family)
#endif

/* A bit a port (65,536 bits): an array lookup is the first thing every state change and every
 * read on the host costs, where a hash lookup cost several times more. */
BPF_ARRAY(watched_ports, u64, 1024);
/* A server socket's port and local address, as server_pids keys them. */
struct server_key {
    u16 sport;
    u16 family;
    u8 saddr[16]; /* 4 bytes for AF_INET (the rest zero), 16 for AF_INET6 */
};
/* (server port, address) -> tgid; user space deletes unwatched ports' entries */
BPF_HASH(server_pids, struct server_key, u32, 4096);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost_events, u64, 1);
BPF_PERCPU_ARRAY(unsignalled, u32, 1);
BPF_ARRAY(departure_woken, u64, 1); /* when a departure last woke the reader (any CPU: races only wake it twice) */
/* The server's address too: a gateway holding a connection to each of two pods of one port from one
 * address may be given one source port for both, and those are two clients. */
struct client_key {
    u16 sport;
    u16 dport;
    u16 family;
    u16 pad;
    u8 daddr[16]; /* the client's address: IPv4 in the first four bytes */
    u8 saddr[16]; /* the server socket's, alike */
};
struct client {
    u64 accepted_ns; /* 0: already connected when its port was watched (added by user space) */
    u64 last_read_ns; /* the server's last read of data from this client */
};
BPF_HASH(clients, struct client_key, struct client, MAX_CLIENTS);
/* CLIENT_SLOT_BITS: 2^bits slots, or 0 where the kernel has no BPF compare-and-swap (before 5.12):
 * then every client goes to the hash and the array's one slot stays empty. */
#ifndef CLIENT_SLOT_BITS
#define CLIENT_SLOT_BITS 0
#endif
struct client_slot {
    u64 owner; /* the socket's address; 0: free. Claimed and released atomically */
    struct client_key key; /* key.sport 0: not (yet, or any more) a client */
    struct client client;
};
#if CLIENT_SLOT_BITS
/* Mapped read-only by user space, which lists the claimed slots without a system call. */
BPF_F_TABLE("array", u32, struct client_slot, client_slots, 1 << CLIENT_SLOT_BITS, BPF_F_MMAPABLE);
#else
BPF_ARRAY(client_slots, struct client_slot, 1);
#endif
/* Counters user space reads where they lie (mapped): clients of the watched ports accepted so far,
 * and the clients this program put in and took out of the hash. With the ones user space puts in and
 * takes out, those tell a listing whether the hash holds any: reading an empty one walks its every
 * bucket. */
#define COUNT_ACCEPTED 0
#define COUNT_HASH_ADDED 1
#define COUNT_HASH_REMOVED 2
BPF_F_TABLE("array", u32, u64, client_counts, 3, BPF_F_MMAPABLE);
struct reset_slot {
    u64 skaddr; /* the socket a reset was just received on, or 0 */
    u64 ts_ns;
};
BPF_PERCPU_ARRAY(reset_sock, struct reset_slot, 1);

static __always_inline void count_lost(void)
{
    u32 zero = 0;
    u64 *lost = lost_events.lookup(&zero);
    if (lost)
        (*lost)++;
}

static __always_inline u64 wakeup_flag(u64 now_ns, int departure)
{
    u32 zero = 0;
    u32 *count = unsignalled.lookup(&zero);
    if (!count)
        return 0; /* cannot happen for an array; fall back to the kernel's adaptive wake-up */
    if (++(*count) >= WAKEUP_EVERY) {
        *count = 0;
        return BPF_RB_FORCE_WAKEUP;
    }
    if (departure) {
        u64 *woken = departure_woken.lookup(&zero);
        if (woken && now_ns - *woken >= DEPARTURE_WAKEUP_NS) {
            *woken = now_ns;
            return BPF_RB_FORCE_WAKEUP;
        }
    }
    return BPF_RB_NO_WAKEUP;
}

#define CLIENT_KEY(k, args, family_)                                                \
    do {                                                                            \
        __builtin_memset(&(k), 0, sizeof(k));                                       \
        (k).sport = (args)->sport;                                                  \
        (k).dport = (args)->dport;                                                  \
        (k).family = (family_);                                                     \
        if ((family_) == AF_INET_) {                                                \
            __builtin_memcpy((k).daddr, (args)->daddr, 4);                          \
            __builtin_memcpy((k).saddr, (args)->saddr, 4);                          \
        } else {                                                                    \
            __builtin_memcpy((k).daddr, (args)->daddr_v6, 16);                      \
            __builtin_memcpy((k).saddr, (args)->saddr_v6, 16);                      \
        }                                                                           \
    } while (0)

/* The slot a socket may claim: its address, multiplied out (Fibonacci hashing). */
static __always_inline struct client_slot *slot_of(u64 skaddr)
{
#if CLIENT_SLOT_BITS
    u32 index = (skaddr * 0x9E3779B97F4A7C15ULL) >> (64 - CLIENT_SLOT_BITS);
    return client_slots.lookup(&index);
#else
    return 0;
#endif
}

/* The socket's own slot: its address and ports (an entry left by an unwatched port's socket at the
 * same address is not it). */
static __always_inline int holds(struct client_slot *slot, u64 skaddr, u16 sport, u16 dport)
{
    return slot && slot->owner == skaddr && slot->key.sport == sport && slot->key.dport == dport;
}

static __always_inline void count_client(u32 which)
{
    u64 *count = client_counts.lookup(&which);
    if (count)
        __sync_fetch_and_add(count, 1);
}

static __always_inline int is_watched(u16 port)
{
    u32 index = port >> 6;
    u64 *word = watched_ports.lookup(&index);
    return word && (*word & (1ULL << (port & 63)));
}

/* Only from a transition the server process itself makes (see the top of this file). */
static __always_inline void note_server(struct server_key *key)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *known = server_pids.lookup(key);
    if (known && *known == tgid)
        return; /* the usual case: a lookup, no update on every close */
    server_pids.update(key, &tgid);
}

/* note_server for the socket of a tracepoint record; a macro, as FILL_EVENT below. */
#define NOTE_SERVER(args, family_)                                                  \
    do {                                                                            \
        struct server_key key_;                                                     \
        __builtin_memset(&key_, 0, sizeof(key_));                                   \
        key_.sport = (args)->sport;                                                 \
        key_.family = (family_);                                                    \
        if ((family_) == AF_INET_)                                                  \
            __builtin_memcpy(key_.saddr, (args)->saddr, 4);                         \
        else                                                                        \
            __builtin_memcpy(key_.saddr, (args)->saddr_v6, 16);                     \
        note_server(&key_);                                                         \
    } while (0)

/* Addresses are copied field by field from the tracepoint record; a macro keeps every access a
 * constant offset into the context, which the verifier accepts. */
#define FILL_EVENT(e, args, family_, kind_, oldstate_)                              \
    do {                                                                            \
        (e)->ts_ns = bpf_ktime_get_ns();                                            \
        (e)->skaddr = (u64)(args)->skaddr;                                          \
        (e)->sport = (args)->sport;                                                 \
        (e)->dport = (args)->dport;                                                 \
        (e)->family = (family_);                                                    \
        (e)->kind = (kind_);                                                        \
        (e)->oldstate = (oldstate_);                                                \
        __builtin_memset((e)->saddr, 0, sizeof((e)->saddr));                        \
        __builtin_memset((e)->daddr, 0, sizeof((e)->daddr));                        \
        if ((family_) == AF_INET_) {                                                \
            __builtin_memcpy((e)->saddr, (args)->saddr, 4);                         \
            __builtin_memcpy((e)->daddr, (args)->daddr, 4);                         \
        } else {                                                                    \
            __builtin_memcpy((e)->saddr, (args)->saddr_v6, 16);                     \
            __builtin_memcpy((e)->daddr, (args)->daddr_v6, 16);                     \
        }                                                                           \
    } while (0)

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP_)
        return 0;
    u16 sport = args->sport;
    if (!is_watched(sport))
        return 0;

    if (args->newstate == TCP_ESTABLISHED_) {
        if (args->oldstate == TCP_SYN_RECV_) { /* a client accepted; no reset slot is touched */
            u64 skaddr = (u64)args->skaddr;
            u64 now = bpf_ktime_get_ns();
            struct client_slot *slot = slot_of(skaddr);
#if CLIENT_SLOT_BITS
            if (slot && __sync_val_compare_and_swap(&slot->owner, 0, skaddr) == 0) {
                slot->client.accepted_ns = slot->client.last_read_ns = now;
                CLIENT_KEY(slot->key, args, args->family); /* sport, which marks it listed, set with the rest */
            } else
#endif
            {
                struct client_key k;
                CLIENT_KEY(k, args, args->family);
                struct client c = {};
                c.accepted_ns = c.last_read_ns = now;
                if (clients.update(&k, &c) == 0)
                    count_client(COUNT_HASH_ADDED);
            }
            count_client(COUNT_ACCEPTED); /* once listed: a listing that saw the count move may lack it */
        }
        return 0;
    }
    if (args->oldstate == TCP_ESTABLISHED_) {
        u64 skaddr = (u64)args->skaddr;
        struct client_slot *slot = slot_of(skaddr);
        if (holds(slot, skaddr, sport, args->dport)) {
            slot->key.sport = 0; /* unlisted first, then free to claim */
#if CLIENT_SLOT_BITS
            __sync_val_compare_and_swap(&slot->owner, skaddr, 0);
#endif
        } else {
            struct client_key k;
            CLIENT_KEY(k, args, args->family);
            if (clients.delete(&k) == 0)
                count_client(COUNT_HASH_REMOVED);
        }
    }

    u32 zero = 0;
    u64 reset = 0, reset_ts = 0;
    struct reset_slot *slot = reset_sock.lookup(&zero);
    if (slot && slot->skaddr) {
        reset = slot->skaddr;
        reset_ts = slot->ts_ns;
        slot->skaddr = 0;
    }

    int oldstate = args->oldstate;
    int newstate = args->newstate;
    u8 kind = 0;
    if (newstate == TCP_CLOSE_WAIT_ && (oldstate == TCP_ESTABLISHED_ || oldstate == TCP_SYN_RECV_)) {
        kind = EVENT_PEER_FIN;
    } else if (newstate == TCP_FIN_WAIT1_ && oldstate == TCP_ESTABLISHED_) {
        kind = EVENT_LOCAL_FIN;
        NOTE_SERVER(args, args->family);
    } else if (newstate == TCP_LAST_ACK_ && oldstate == TCP_CLOSE_WAIT_) {
        NOTE_SERVER(args, args->family); /* the server's close() after the client's FIN: no event */
        return 0;
    } else if (newstate == TCP_CLOSE_ && oldstate != TCP_LISTEN_ && oldstate != TCP_FIN_WAIT1_
               && oldstate != TCP_FIN_WAIT2_ && oldstate != TCP_CLOSING_
               && !(reset == (u64)args->skaddr && bpf_ktime_get_ns() - reset_ts < RESET_CLOSE_NS)) {
        kind = EVENT_CLOSED; /* not a listener; not after local_fin; not the reset's own close */
    } else {
        return 0;
    }

    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        count_lost();
        return 0;
    }
    FILL_EVENT(e, args, args->family, kind, oldstate);
    events.ringbuf_submit(e, wakeup_flag(e->ts_ns, kind == EVENT_PEER_FIN));
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    u16 sport = args->sport;
    if (!is_watched(sport))
        return 0;

    u32 zero = 0;
    struct reset_slot *slot = reset_sock.lookup(&zero);
    if (slot) { /* the CLOSE that follows is this reset's: see the top */
        slot->skaddr = (u64)args->skaddr;
        slot->ts_ns = bpf_ktime_get_ns();
    }

    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        count_lost();
        return 0;
    }
    u16 family = TCP_FAMILY(args);
    FILL_EVENT(e, args, family, EVENT_PEER_RST, 0);
    events.ringbuf_submit(e, wakeup_flag(e->ts_ns, 1));
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    u16 sport = args->sport;
    if (!is_watched(sport)) /* every read on the host comes here: most end at this lookup */
        return 0;
    u64 skaddr = (u64)args->skaddr;
    struct client_slot *slot = slot_of(skaddr);
    if (holds(slot, skaddr, sport, args->dport)) {
        slot->client.last_read_ns = bpf_ktime_get_ns();
        return 0;
    }
    struct client_key k;
    u16 family = TCP_FAMILY(args);
    CLIENT_KEY(k, args, family);
    struct client *c = clients.lookup(&k);
    if (c)
        c->last_read_ns = bpf_ktime_get_ns();
    return 0;
}
