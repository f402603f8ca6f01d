//! The egress guard of media fetches: which resolved addresses a media URL may not reach
//! (`--media-egress-block-private`, vLLM's `VLLM_MEDIA_EGRESS_BLOCK_PRIVATE`).
//!
//! Blocked: loopback, private (RFC 1918, IPv6 unique-local), link-local (169.254/16, where cloud
//! metadata lives, and fe80::/10), unspecified, broadcast, multicast, reserved (240/4, ::/8,
//! site-local fec0::/10), documentation and benchmarking ranges, IETF protocol assignments,
//! CGNAT 100.64/10, 6to4 2002::/16 and NAT64 64:ff9b::/96 and 64:ff9b:1::/48 (those two embed an
//! IPv4 destination). An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) is judged as its IPv4.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether a media fetch must not connect to `ip`.
pub(crate) fn is_blocked(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_blocked(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4_blocked(v4),
            None => v6_blocked(v6),
        },
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], prefix: u32) -> bool {
    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
    (u32::from(ip) & mask) == (u32::from(Ipv4Addr::from(net)) & mask)
}

fn v4_blocked(ip: Ipv4Addr) -> bool {
    const NETS: [([u8; 4], u32); 15] = [
        ([0, 0, 0, 0], 8),       // "this network", unspecified
        ([10, 0, 0, 0], 8),      // private
        ([100, 64, 0, 0], 10),   // CGNAT (RFC 6598)
        ([127, 0, 0, 0], 8),     // loopback
        ([169, 254, 0, 0], 16),  // link-local, cloud metadata
        ([172, 16, 0, 0], 12),   // private
        ([192, 0, 0, 0], 24),    // IETF protocol assignments
        ([192, 0, 2, 0], 24),    // documentation
        ([192, 88, 99, 0], 24),  // 6to4 relay anycast
        ([192, 168, 0, 0], 16),  // private
        ([198, 18, 0, 0], 15),   // benchmarking
        ([198, 51, 100, 0], 24), // documentation
        ([203, 0, 113, 0], 24),  // documentation
        ([224, 0, 0, 0], 4),     // multicast
        ([240, 0, 0, 0], 4),     // reserved, broadcast
    ];
    NETS.iter().any(|&(net, prefix)| in_v4(ip, net, prefix))
}

fn in_v6(ip: Ipv6Addr, net: [u16; 8], prefix: u32) -> bool {
    let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
    (u128::from(ip) & mask) == (u128::from(Ipv6Addr::from(net)) & mask)
}

fn v6_blocked(ip: Ipv6Addr) -> bool {
    const NETS: [([u16; 8], u32); 11] = [
        ([0, 0, 0, 0, 0, 0, 0, 0], 8), // reserved: ::, ::1, IPv4-compatible
        ([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96), // NAT64
        ([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48), // local-use NAT64
        ([0x100, 0, 0, 0, 0, 0, 0, 0], 64), // discard-only
        ([0x2001, 0, 0, 0, 0, 0, 0, 0], 23), // IETF protocol assignments (Teredo, ...)
        ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32), // documentation
        ([0x2002, 0, 0, 0, 0, 0, 0, 0], 16), // 6to4
        ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7), // unique local
        ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), // link-local
        ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), // site-local (deprecated)
        ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), // multicast
    ];
    NETS.iter().any(|&(net, prefix)| in_v6(ip, net, prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(s: &str) -> bool {
        is_blocked(s.parse().unwrap())
    }

    #[test]
    fn private_and_special_addresses_are_blocked_public_ones_are_not() {
        for s in [
            "127.0.0.1",
            "10.1.2.3",
            "172.31.255.255",
            "192.168.0.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:169.254.169.254",
            "::ffff:127.0.0.1",
            "2002:7f00:1::",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(blocked(s), "{s} must be blocked");
        }
        for s in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
        ] {
            assert!(!blocked(s), "{s} must pass");
        }
    }
}
