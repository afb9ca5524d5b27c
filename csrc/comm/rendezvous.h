// Rendezvous of a process group at MASTER_ADDR:MASTER_PORT: rank 0 serves a TcpStore, every rank
// announces itself under <prefix>/join/<rank> and waits for the others. A timeout names the ranks that
// never arrived; a WORLD_SIZE that differs between ranks is reported too.
#pragma once
#include <memory>
#include <string>

#include "comm/comm.h"
#include "comm/tcp_store.h"

namespace gpt2::dist {

std::unique_ptr<TcpStore> rendezvous(const RendezvousOptions& opts);

// The address other ranks can reach this process at: opts.hostname when set; 127.0.0.1 when
// master_addr is a loopback address; otherwise the local address of the route to master_addr.
std::string local_address(const RendezvousOptions& opts);

// "1, 3" from {1, 3}; "1, 2, 3, ... (40 ranks)" when long.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace gpt2::dist
